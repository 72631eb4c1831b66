"""Suite-wide settings, applied before any test module imports torch."""

import os

# The suite runs two xdist workers plus engine processes on a couple of cores: OpenMP threads
# that spin at barriers would burn the time slices their descheduled peers need (atom's default
# is a short spin, right for a machine the engine has to itself). Child processes inherit this.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
