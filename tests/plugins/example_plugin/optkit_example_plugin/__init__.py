"""An example of a pass package for optkit: installing it makes ``clamp_weights`` a registered pass."""
