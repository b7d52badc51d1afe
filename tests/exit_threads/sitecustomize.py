"""Put on PYTHONPATH by tests that start training processes: with EXIT_THREADS_DIR set, every Python
process records the native threads still alive at the very end of its exit (this runs first at start,
so its atexit handler runs last), one file per process: <pid>.txt, a thread name per line. A process
group released deterministically leaves none of gloo's threads there."""
import atexit
import os


def _record():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    with open(os.path.join(os.environ["EXIT_THREADS_DIR"], f"{os.getpid()}.txt"), "w") as f:
        f.write("\n".join(sorted(names)) + "\n")


if os.environ.get("EXIT_THREADS_DIR"):
    atexit.register(_record)
