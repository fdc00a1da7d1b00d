import sys

from mempath.cli import main

sys.exit(main())
