#!/usr/bin/python3
"""Prints the default model's held-out text: every 20th KJV chapter, as
train_default_model.py holds it out, each preceded by <|endoftext|> and the last followed
by one. Tokenized with special tokens parsed and no BOS, it is the token stream whose
windows of 256 + 1 the training script scored (training_log.json "heldout_loss"):

  /usr/bin/python3 models/kjv_heldout_text.py > /tmp/kjv-heldout.txt
  build/clients/cli/kvlens-cli perplexity --model models/kjv-gpt2-4l \\
      --file /tmp/kjv-heldout.txt --no-bos
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_default_model import EOT, HELDOUT_EVERY, load_kjv_chapters  # noqa: E402


def main():
    chapters = load_kjv_chapters()
    held = [t for i, (_, t) in enumerate(chapters) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    sys.stdout.write(EOT + EOT.join(held) + EOT)


if __name__ == "__main__":
    main()
