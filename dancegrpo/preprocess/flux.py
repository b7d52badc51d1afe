"""`python -m dancegrpo.preprocess.flux`: the flux family's prompt-embedding writer
(dancegrpo.models.flux.preprocess), under the name its documented command has."""
from ..models.flux.preprocess import *  # noqa: F401,F403  (the writer's names, as before the move)
from ..models.flux.preprocess import main

if __name__ == "__main__":
    main()
