"""Rewards of the digits world (dancegrpo.digits): does the image show the prompted digit?

- `digit` (train on it): the probability a multinomial logistic regression gives the prompted
  digit, on the image's 8x8 box-averaged grey levels. Smooth in the image, so GRPO's advantages
  rank samples finely.
- `digit_heldout` (evaluate with it): 1 when a different classifier, 5-nearest-neighbours on the
  same features, names the prompted digit, else 0; its mean is the held-out correct-class rate.
  A different model family, so that a policy gaming the first classifier does not also score
  here (the analogue of training on HPSv2 and evaluating on PickScore).

Both classifiers come from dancegrpo.digits.classifiers (fitted at first use); their accuracy
on the held-out real digits is in the tests.
"""
import torch

from ..digits import data
from ..errors import ConfigError
from ..digits.classifiers import logistic_classifier, neighbours_classifier


def _targets(prompts):
    return [data.digit_of_prompt(p) for p in prompts]


class DigitProbability:
    def __init__(self, classifier):
        self.classifier = classifier

    def __call__(self, images, prompts):
        proba = self.classifier.predict_proba(data.features(images))
        return torch.tensor([proba[i, d] for i, d in enumerate(_targets(prompts))], dtype=torch.float32)


class DigitCorrect:
    def __init__(self, classifier):
        self.classifier = classifier

    def __call__(self, images, prompts):
        predicted = self.classifier.predict(data.features(images))
        return torch.tensor([float(p == d) for p, d in zip(predicted, _targets(prompts))], dtype=torch.float32)


def build_digit(device=None, options=None):
    return DigitProbability(logistic_classifier())


def build_heldout(device=None, options=None):
    return DigitCorrect(neighbours_classifier())


def check_prompts(name, captions, source):
    """Before training: every prompt names one digit (the reward reads its target from the prompt)."""
    bad = []
    for caption in captions:
        try:
            data.digit_of_prompt(caption)
        except ValueError:
            bad.append(caption)
    if bad:
        raise ConfigError(f"reward {name!r} scores the digit a prompt names, but {len(bad)} of {len(captions)} "
                          f"prompts in {source!r} name no single digit (e.g. {bad[0]!r}): train it on the digits "
                          "world (--preset digits) or on prompts naming one digit 0-9, or choose another reward")
