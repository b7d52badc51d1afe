"""`python -m dancegrpo.preprocess.qwenimage`: the qwenimage family's prompt-embedding writer (its encoder is
dancegrpo.models.qwenimage.preprocess), under the name its documented command has."""
from ..models.qwenimage.preprocess import *  # noqa: F401,F403  (the encoder's names, as before the move)
from . import common


def main(argv=None):
    return common.main_for("qwenimage", argv)


if __name__ == "__main__":
    main()
