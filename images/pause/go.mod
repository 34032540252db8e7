module rekindle.dev/pause

go 1.22
