"""`python -m dancegrpo.preprocess.qwenimage`: the qwenimage family's prompt-embedding writer
(dancegrpo.models.qwenimage.preprocess), under the name its documented command has."""
from ..models.qwenimage.preprocess import *  # noqa: F401,F403  (the writer's names, as before the move)
from ..models.qwenimage.preprocess import main

if __name__ == "__main__":
    main()
