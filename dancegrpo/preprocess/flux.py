"""`python -m dancegrpo.preprocess.flux`: the flux family's prompt-embedding writer (its encoder is
dancegrpo.models.flux.preprocess), under the name its documented command has."""
from ..models.flux.preprocess import *  # noqa: F401,F403  (the encoder's names, as before the move)
from . import common


def main(argv=None):
    return common.main_for("flux", argv)


if __name__ == "__main__":
    main()
