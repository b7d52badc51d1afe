"""What torchrun tells a process before any process group exists (its rank, the rank count), and a
line said once per run: read from the environment, without torch, by launchers and command lines."""
import os
import sys

from ..errors import say


def launch_rank():
    """This process's rank as torchrun set it (0 outside torchrun): known before the group exists, and
    in tools and launchers that never join one."""
    return int(os.environ.get("RANK", "0"))


def launch_world_size():
    """The number of ranks torchrun started (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def print_on_rank0(message, file=None):
    """A line said once per run, not once per rank."""
    if launch_rank() == 0:
        say(message, sys.stdout if file is None else file)
