"""``python -m turbotrain.cli`` runs the ``turbotrain`` command."""

import sys

from . import main

sys.exit(main())
