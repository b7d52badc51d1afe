"""`python -m dancegrpo.preprocess --family NAME [the family's flags]`: the prompt-embedding writer of
any registered family (dancegrpo.models.registry); `python -m dancegrpo.preprocess.<family>` is the
same writer for the families of this repository."""
import sys

from ..errors import say
from ..models.registry import family_names
from .common import main_for


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) < 2 or argv[0] != "--family":
        say(f"usage: python -m dancegrpo.preprocess --family {{{','.join(family_names())}}} [its flags, see "
            "--family NAME --help]")
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    if argv[1] not in family_names():
        say(f"error: unknown --family {argv[1]!r}; known: {family_names()}")
        raise SystemExit(2)
    return main_for(argv[1], argv[2:])


if __name__ == "__main__":
    main()
