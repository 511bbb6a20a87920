"""Tests: request intake and the bad-input fuzz corpus."""
