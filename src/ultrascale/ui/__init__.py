"""The local web app (`ultrascale ui`: memory widget, layout explorer, run dashboard) and the same
pictures as PNG files (`ultrascale memory --plot`, `ultrascale plot`). docs/ui.md has the commands.

Nothing is imported here: `ultrascale memory --plot` loads only `pictures`, not the server."""
