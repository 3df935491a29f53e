#!/usr/bin/env python3
"""Writes chat_template_vectors.json from llama.cpp's tests/test-chat-template.cpp (MIT).

Each of that file's test cases is a model's Jinja chat template and the text llama.cpp's
built-in formatter writes for one conversation (system, user, assistant, user, assistant
with surrounding spaces, user; the assistant's opening added). kvlens' chat_template_test
checks that DetectChatFormat picks `format` for the template and that ApplyChatTemplate
writes `expected`; `format` is null for the families kvlens does not write.

  make_chat_template_vectors.py LLAMA_CPP/tests/test-chat-template.cpp > chat_template_vectors.json

(llama.cpp's source comes with node-llama-cpp's npm package as a git bundle:
scripts/fetch-test-vocabs.sh shows how to unpack it.)
"""
import json
import re
import sys

# The family each test case belongs to, by its name in llama.cpp's file.
FORMATS = {
    "teknium/OpenHermes-2.5-Mistral-7B": "chatml",
    "mistralai/Mistral-7B-Instruct-v0.2 (NOTE: Old pre-v1 without a system prompt)": "llama2",
    "TheBloke/FusionNet_34Bx2_MoE-AWQ": "llama2-sys-bos",
    "bofenghuang/vigogne-2-70b-chat": "llama2-sys-strip",
    "google/gemma-7b-it": "gemma",
    "deepseek-ai/deepseek-coder-33b-instruct": "deepseek-coder",
    "eachadea/vicuna-13b-1.1": "vicuna",
    "Orca-Vicuna": "vicuna-orca",
    "CohereForAI/c4ai-command-r-plus": "command-r",
    "Llama-3": "llama3",
    "Phi-3-mini": "phi3",
    "Phi-3-small": "phi3",
    "Phi-3-medium": "phi3",
    "Phi-3-vision": "phi3",
    "MiniCPM-3B-OpenHermes-2.5-v2-GGUF": "minicpm",
    "DeepSeek-V2": "deepseek2",
    "mistralai/Mistral-7B-Instruct-v0.2 (mistralai 'v1' template with a system prompt)": "mistral-v1",
    "Mistral-Large-Instruct-2407 (mistralai 'v3' template; modified to have system prompt at start)": "mistral-v3",
    "Mistral-Nemo-Instruct-2407 (mistralai 'v3-tekken' template; modified to have system prompt at start)": "mistral-v3-tekken",
    "mistralai/Mistral-Large-Instruct-2411 (mistralai 'v7' template)": "mistral-v7",
    "phi-4": "phi4",
}


def entries(body):
    """The top-level { … } initialisers of the test_cases vector, string literals intact."""
    out, buf, depth, in_str, esc = [], "", 0, False, False
    for ch in body:
        if in_str:
            buf += ch
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
            if depth == 1:
                buf = ""
                continue
        elif ch == "}":
            depth -= 1
            if depth == 0:
                out.append(buf)
                continue
        if depth >= 1:
            buf += ch
    return out


def fields(entry):
    out = {}
    for m in re.finditer(r'/\*\s*\.(\w+)\s*=?\s*\*/\s*(?:U8C\()?"((?:[^"\\]|\\.)*)"', entry):
        raw = m.group(2)
        out[m.group(1)] = raw.encode("utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8")
    return out


def main():
    src = open(sys.argv[1], encoding="utf-8").read()
    start = src.index("std::vector<TestCase> test_cases {")
    body = src[src.index("{", start) + 1 : src.index("\n    };\n", start)]
    vectors = []
    for e in entries(body):
        f = fields(e)
        if "extra_conversation" in e and "{{" in e.split("extra_conversation")[1]:
            continue  # tool-call conversations: roles kvlens does not take
        vectors.append({"name": f["name"], "template": f["template_str"],
                        "expected": f["expected_output"], "format": FORMATS.get(f["name"])})
    json.dump({"source": "llama.cpp tests/test-chat-template.cpp (MIT)", "vectors": vectors},
              sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
