"""Tests of the GPU consumer against a real broker."""
