"""Run every ```python block of one documentation page, in order, in one
namespace (later blocks use what earlier ones defined), in the current
folder. A block that raises ends the run with its traceback, naming the
page and the block's first line number.

    python tests/_support/doc_snippets.py docs/guides/force_matching.md [--first]
"""
import re
import sys
import traceback

FENCE = re.compile(r"^```python\s*$")


def blocks(text):
    """(first line number, source) of every ```python block."""
    out, current, start = [], None, 0
    for number, line in enumerate(text.split("\n"), 1):
        if current is None and FENCE.match(line):
            current, start = [], number + 1
        elif current is not None and line.startswith("```"):
            out.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        raise SystemExit(f"unclosed ```python block from line {start}")
    return out


def main(path, only_first=False):
    found = blocks(open(path).read())[:1 if only_first else None]
    namespace = {"__name__": "__docs__"}
    for start, source in found:
        try:
            # padded so that tracebacks give the line numbers of the page
            exec(compile("\n" * (start - 1) + source, path, "exec"), namespace)
        except BaseException:
            traceback.print_exc()
            print(f"FAILED: the block of {path} at line {start}", file=sys.stderr)
            return 1
    print(f"{path}: {len(found)} block(s) ran")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], only_first="--first" in sys.argv[2:]))
