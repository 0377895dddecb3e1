"""Deployment planning (CAUCHY, paper 004): cost efficiency, combos, allocation; pure code the gateway and
the simulator share."""
