"""``python -m lowdiff``."""

from lowdiff.cli.main import entry

if __name__ == "__main__":
    entry()
