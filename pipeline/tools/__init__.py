"""What stands above the consumers and the sink: it runs, watches, measures and breaks them from outside;
nothing below imports it."""
