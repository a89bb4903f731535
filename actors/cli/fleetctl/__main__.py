"""``python -m actors.cli.fleetctl``: runs fleetctl."""

import sys

from actors.cli.fleetctl.main import main

sys.exit(main())
