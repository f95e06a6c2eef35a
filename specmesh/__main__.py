import sys

from specmesh.cli.main import main

sys.exit(main())
