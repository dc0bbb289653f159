# SPDX-License-Identifier: Apache-2.0
"""``python -m hila.experiments {mqar,niah,report} ...`` (see hila.experiments.cli)."""
import sys

from .cli import main

sys.exit(main())
