import sys

from aioengine.spec_decode.train.cli import main

sys.exit(main())
