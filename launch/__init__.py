"""Launchers: local torchrun and Slurm."""
