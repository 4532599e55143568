"""``python -m dynamicemb.plan``: show, validate and generate HugeCTR plan files."""

import sys

from dynamicemb.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
