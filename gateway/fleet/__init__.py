"""The live fleet's changes: the autoscaler's loop and the actuator seam that starts and stops engines."""
