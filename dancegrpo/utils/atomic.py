"""A file under its final name is always whole: written to a temporary name beside it and renamed
into place (os.replace is atomic); a failed write (a full disk) leaves no temporary behind."""
import os


def write_atomically(path, write):
    """write(tmp) writes the file at the path it is given; it becomes `path` only once complete."""
    root, ext = os.path.splitext(path)
    tmp = f"{root}.tmp-{os.getpid()}{ext}"   # the extension kept: PIL picks the format by it
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def write_text(path, text):
    """`text` as the file at `path` (its folder made), whole or not at all."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(tmp):
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
    return write_atomically(path, write)
