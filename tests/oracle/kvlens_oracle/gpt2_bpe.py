"""GPT-2 byte-level BPE from a Hugging Face tokenizer.json (model.vocab + model.merges).

Pre-tokenization uses GPT-2's pattern with \\p{L} -> [^\\W\\d_] and \\p{N} -> \\d so that
Python's `re` suffices (exact for ASCII text)."""
import json
import re

PRETOKENIZE = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")


def _byte_chars():
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class ByteBPE:
    def __init__(self, vocab, merges, added=()):
        self.vocab, self.inv = vocab, {i: t for t, i in vocab.items()}
        for tok in added:
            self.inv[tok["id"]] = tok["content"]
        self.special = {tok["id"] for tok in added}
        self.rank = {tuple(m.split(" ") if isinstance(m, str) else m): r for r, m in enumerate(merges)}
        self.b2c = _byte_chars()
        self.c2b = {c: b for b, c in self.b2c.items()}

    @classmethod
    def from_tokenizer_json(cls, path):
        with open(path) as f:
            j = json.load(f)
        return cls(j["model"]["vocab"], j["model"]["merges"], j.get("added_tokens", []))

    def _word(self, w):
        parts = [self.b2c[b] for b in w.encode("utf-8")]
        while len(parts) > 1:
            ranked = [(self.rank.get(p, float("inf")), i) for i, p in enumerate(zip(parts, parts[1:]))]
            r, i = min(ranked)
            if r == float("inf"):
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [self.vocab[p] for p in parts]

    def encode(self, text):
        return [i for w in PRETOKENIZE.findall(text) for i in self._word(w)]

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            t = self.inv[int(i)]
            out.extend(t.encode() if int(i) in self.special else bytes(self.c2b[c] for c in t))
        return out.decode("utf-8", errors="replace")
