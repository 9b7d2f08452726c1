"""`python -m routing.modelserver`: the stand-in model server under its former name.

Service files written before the routing package was split by role start replicas with this
command line; it runs routing.standin.server, the same program (docs/services.md).
"""

import sys

from routing.standin.server import main

if __name__ == "__main__":
    sys.exit(main())
