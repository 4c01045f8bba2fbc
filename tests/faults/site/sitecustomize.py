"""Imported at the start of every interpreter of a fault-test run (its PYTHONPATH holds this
directory): installs the slow points its environment asks for (fault_points.py)."""

import fault_points

fault_points.install()
