from rewriter.cli import main

main()
