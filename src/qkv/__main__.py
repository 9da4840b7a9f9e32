import sys

from qkv.cli import main

sys.exit(main())
