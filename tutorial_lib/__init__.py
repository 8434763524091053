"""Plumbing for the multi-device TensorFlow course; each module is one idea.

Import modules by name (``from tutorial_lib import devices``); importing the package
does not import TensorFlow, so ``devices.simulate`` can still configure it.
"""
