"""systemd: unit files (parse, edit, quote, render) and the manager itself (systemctl, the journal)."""
