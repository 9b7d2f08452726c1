import sys

from cpn.cli import main

sys.exit(main())
