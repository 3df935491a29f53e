"""A small sentencepiece-BPE encoder/decoder that follows llama2.c's run.c.

tok512.bin layout: int32 max_token_length, then per token: float32 score, int32 length,
bytes. Pieces store "▁" as a plain space; byte tokens are "<0xNN>".
"""
import struct

BOS, EOS = 1, 2


class SpmTokenizer:
    def __init__(self, pieces, scores):
        self.pieces, self.scores = pieces, scores
        self.index = {}
        for i, p in enumerate(pieces):
            self.index.setdefault(p, i)  # first occurrence wins, as a sorted-vocab search would
        self.byte_id = {}
        for i, p in enumerate(pieces):
            if len(p) == 6 and p.startswith("<0x") and p.endswith(">"):
                self.byte_id[int(p[3:5], 16)] = i

    @classmethod
    def from_llama2c(cls, path):
        with open(path, "rb") as f:
            buf = f.read()
        off, pieces, scores = 4, [], []
        while off < len(buf):
            score, n = struct.unpack_from("<fi", buf, off)
            off += 8
            pieces.append(buf[off:off + n].decode("utf-8", errors="surrogateescape"))
            scores.append(score)
            off += n
        return cls(pieces, scores)

    @classmethod
    def from_gguf_metadata(cls, md):
        return cls([p.replace("\u2581", " ") for p in md["tokenizer.ggml.tokens"]],
                   list(md["tokenizer.ggml.scores"]))

    def encode(self, text, bos=True, eos=False):
        ids = [BOS] if bos else []
        if text:
            text = " " + text  # sentencepiece's dummy prefix
        toks = []
        for ch in text:  # code points; unknown ones fall back to their UTF-8 bytes
            if ch in self.index:
                toks.append(self.index[ch])
            else:
                toks.extend(self.byte_id[b] for b in ch.encode("utf-8"))
        while True:  # merge the adjacent pair whose merged piece has the best score
            best, best_i = None, -1
            for i in range(len(toks) - 1):
                j = self.index.get(self.pieces[toks[i]] + self.pieces[toks[i + 1]])
                if j is not None and (best is None or self.scores[j] > self.scores[best]):
                    best, best_i = j, i
            if best is None:
                break
            toks[best_i:best_i + 2] = [best]
        return ids + toks + ([EOS] if eos else [])

    def decode(self, ids, prev=BOS):
        out = bytearray()
        for t in ids:
            p = self.pieces[t]
            if prev == BOS and p.startswith(" "):
                p = p[1:]  # run.c strips the dummy-prefix space after BOS
            if t in self.byte_id.values() and p.startswith("<0x"):
                out.append(int(p[3:5], 16))
            else:
                out.extend(p.replace("\u2581", " ").encode("utf-8", errors="surrogateescape"))
            prev = t
        return out.decode("utf-8", errors="replace")
