#!/usr/bin/env python3
"""docs/OPERATIONS.md's flag list is `wprepd --help`, verbatim (ctest: flags_doc).

The list is the fenced block right after the line "<!-- wprepd --help -->". Fails, with a
diff, when the block and the daemon's --help differ; with --write, puts the --help text
in the block instead.
Usage: check_flags_doc.py [--write] WPREPD OPERATIONS.md
"""
import difflib
import subprocess
import sys

MARKER = "<!-- wprepd --help -->"


def main(argv):
    write = "--write" in argv
    args = [a for a in argv if a != "--write"]
    if len(args) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wprepd, doc = args
    r = subprocess.run([wprepd, "--help"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        print(f"{wprepd} --help exited {r.returncode}: {r.stderr}", file=sys.stderr)
        return 1
    help_lines = r.stdout.splitlines()
    lines = open(doc, encoding="utf-8").read().split("\n")
    try:
        at = lines.index(MARKER)
    except ValueError:
        print(f"{doc}: no line '{MARKER}' before the flag block", file=sys.stderr)
        return 1
    start = at + 1
    if start >= len(lines) or not lines[start].startswith("```"):
        print(f"{doc}:{start + 1}: the line after '{MARKER}' must open a fenced block", file=sys.stderr)
        return 1
    end = start + 1
    while end < len(lines) and lines[end] != "```":
        end += 1
    if end == len(lines):
        print(f"{doc}:{start + 1}: the flag block is never closed", file=sys.stderr)
        return 1
    block = lines[start + 1:end]
    if block == help_lines:
        return 0
    if write:
        lines[start + 1:end] = help_lines
        open(doc, "w", encoding="utf-8").write("\n".join(lines))
        return 0
    sys.stdout.writelines(difflib.unified_diff([l + "\n" for l in block], [l + "\n" for l in help_lines],
                                               f"{doc} (flag block)", "wprepd --help"))
    print(f"\n{doc}'s flag block differs from `wprepd --help`; regenerate it with\n"
          f"  {sys.argv[0]} --write {wprepd} {doc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
