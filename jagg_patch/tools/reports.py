"""How a tool hands back what it measured: the report printed, the numbers (JSON) and the report
(markdown) written where the command line asked."""
import json
import os


def print_and_write(report, result, json_path=None, md_path=None):
    print(report, flush=True)
    for path, text in ((json_path, json.dumps(result, indent=1)), (md_path, report + "\n")):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
