from rekindle_front.cli import main

main()
