import sys

from specmesh.main import main

sys.exit(main())
