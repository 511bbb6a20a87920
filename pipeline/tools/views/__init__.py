"""What people look at: the terminal report, the local board and the Grafana push (the boards themselves live in dashboards/)."""
