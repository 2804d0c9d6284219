"""pagemesh: the `pagemesh` command and the runtime every service shares."""

__version__ = "0.1.0"
