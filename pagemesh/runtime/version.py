"""The package's version, one place: `pagemesh.__version__` and the services'
`pagemesh_build_info` metric read it."""

VERSION = "0.1.0"
