import sys

from nvl72.cli import main

sys.exit(main())
