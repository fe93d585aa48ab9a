import sys

from jaxremat.tools.cli import main

sys.exit(main())
