"""Tests: runners (tiny real models, MiniLM, simulated runners, poison isolation)."""
