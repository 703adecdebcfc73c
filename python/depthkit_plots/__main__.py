import sys

from .figures import FIGURES, render


def main(argv):
    if len(argv) != 3 or argv[0] not in FIGURES:
        print(f"usage: python -m depthkit_plots {{{','.join(FIGURES)}}} DATA.json OUT.png", file=sys.stderr)
        return 2
    try:
        render(*argv)
    except Exception as e:  # one line, naming the files, for the calling command
        print(f"depthkit_plots: error: {argv[0]} from {argv[1]}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


sys.exit(main(sys.argv[1:]))
