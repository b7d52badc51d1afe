"""The argument parser every command line of this repository uses: no abbreviated flags (argparse
takes `--jagg_win 8` for `--jagg_window 8`, and a later flag of that prefix would silently change
what an old command means), an unknown flag named before a missing required one, and an error as
one line with a hint instead of the whole usage."""
import argparse


class CommandParser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\nhint: `{self.prog} --help` lists every flag\n")

    def parse_args(self, args=None, namespace=None):
        """argparse reports a missing required argument before an unknown one (a typo of a flag then
        reads as `--output_dir is required`): the unknown ones are looked for first."""
        required = [a for a in self._actions if a.required]
        for action in required:
            action.required = False
        try:
            _, unknown = super().parse_known_args(args, None if namespace is None else argparse.Namespace(
                **vars(namespace)))
        finally:
            for action in required:
                action.required = True
        if unknown:
            self.error(f"unrecognized arguments: {' '.join(unknown)}")
        return super().parse_args(args, namespace)


def typed_flags(parser, argv):
    """{dest: the option string written on the command line} (a flag with two spellings, upstream's
    --fsdp_sharding_startegy and --fsdp_sharding_strategy, is named in errors as the user wrote it)."""
    actions = parser._option_string_actions  # argparse has no public map from option string to dest
    return {actions[tok.split("=", 1)[0]].dest: tok.split("=", 1)[0] for tok in argv
            if tok.split("=", 1)[0] in actions}


def flag_as_typed(args, dest, default):
    """The option string the user wrote for `dest`, else `default` (how errors name a flag)."""
    return getattr(args, "typed_flags", {}).get(dest, default)
