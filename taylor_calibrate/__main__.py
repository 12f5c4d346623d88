import sys

from taylor_calibrate.cli import main

sys.exit(main())
