import sys

from jaxremat.cli import main

sys.exit(main())
