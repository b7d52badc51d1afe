"""Digits and their prompts.

Images: sklearn.datasets.load_digits (8x8, 17 grey levels 0..16), split once into a training
part (what generators and the reward classifier learn from) and a held-out part (what accuracy
is measured on), seeded and stratified. Rendered grey on black as RGB at `size` px (bilinear
upsampling of the 8x8 grid); `features` is the inverse road: any image -> 8x8 box-averaged
grey levels in [0, 1], what the classifiers read.

Prompts: a few phrasings per digit ("a handwritten 7", "the digit seven", ...);
`digit_of_prompt` reads the digit back (numeral or English word).
"""
import re

import numpy as np
from PIL import Image

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
PHRASINGS = ("a handwritten {n}", "the digit {word}", "a drawing of the number {word}",
             "the number {n}, written by hand")
HELDOUT_FRACTION = 0.3
SPLIT_SEED = 0
_NUMBER = re.compile(r"\b([0-9]|" + "|".join(WORDS) + r")\b", re.IGNORECASE)


def prompts_for(digit):
    return [p.format(n=digit, word=WORDS[digit]) for p in PHRASINGS]


def all_prompts():
    """Every (prompt, digit), digit-major."""
    return [(p, d) for d in range(10) for p in prompts_for(d)]


def digit_of_prompt(prompt):
    """The one digit a prompt names (numeral or word), else ValueError naming the prompt."""
    found = {int(m) if m.isdigit() else WORDS.index(m.lower()) for m in _NUMBER.findall(prompt)}
    if len(found) != 1:
        raise ValueError(f"prompt {prompt!r} names {'no digit' if not found else 'several digits'}; the digit "
                         "rewards need prompts that name one digit (0-9 or zero..nine), e.g. 'a handwritten 7'")
    return found.pop()


def load_split():
    """((train images [N, 8, 8] float in [0, 1], labels [N]), (held-out images, labels)), fixed split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    data = load_digits()
    images = data.images.astype(np.float32) / 16.0
    tr_x, te_x, tr_y, te_y = train_test_split(images, data.target, test_size=HELDOUT_FRACTION,
                                              random_state=SPLIT_SEED, stratify=data.target)
    return (tr_x, tr_y), (te_x, te_y)


def render(images, size=64):
    """8x8 grey levels in [0, 1] -> RGB PIL images of size x size, white digit on black."""
    out = []
    for im in images:
        grey = Image.fromarray(np.round(np.clip(im, 0, 1) * 255).astype(np.uint8), mode="L")
        out.append(grey.resize((size, size), Image.BILINEAR).convert("RGB"))
    return out


def features(pil_images):
    """Any RGB / grey PIL images -> [N, 64] float32 box-averaged 8x8 grey levels in [0, 1]."""
    rows = [np.asarray(im.convert("L").resize((8, 8), Image.BOX), dtype=np.float32).reshape(-1) / 255.0
            for im in pil_images]
    return np.stack(rows)
