from dtrain.estimate.app import main

main()
