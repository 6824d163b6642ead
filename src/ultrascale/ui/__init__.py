"""The local web app (`ultrascale ui`: memory widget, layout explorer, run dashboard) and
`ultrascale plot` (a run's curves as a PNG). docs/ui.md has the commands.

Nothing is imported here: the CLI registers `ui` and `plot` without loading the server."""
