"""`tpla bench …`: measurements reported as ratios from one run on one machine."""
